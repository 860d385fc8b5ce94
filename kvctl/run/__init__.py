"""``kvctl run``: the experiments (chunk-sweep, overlap), their output and plots."""
