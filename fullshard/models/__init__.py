"""Models written plainly in the project (the main job and the tests use them)."""
