"""nanochat's update rule on arrays: the polar iteration, the AdamW and Muon kernels and
the groups' hyperparameters. Imports nothing else from the package."""
