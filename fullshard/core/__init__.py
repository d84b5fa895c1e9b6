"""Framework-free runtime machinery both runtimes share (ownership types, byte and traffic meters)."""
