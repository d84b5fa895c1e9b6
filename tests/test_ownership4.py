"""An aliasing "copy" re-introduced at the owned-buffer sites only more than 2 ranks reach (the pairwise
reduce-scatter's receive buffers, the chunks kept for reshard_after_forward=2), on 4 gloo ranks."""
from tests.harness import suite_tests

results, test_scenario = suite_tests("tests.suite_ownership:four_rank_sites", world_sizes=(4,),
                                     env={"FULLSHARD_CHECK_OWNERSHIP": "1"})
