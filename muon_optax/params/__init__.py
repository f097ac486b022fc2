"""What the params are: Flax variables, labels, dimension numbers, and the matrices the
Muon leaves hold, stacked by shape."""
