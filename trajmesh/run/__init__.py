"""Run tooling: the `trajmesh` command line (cli), a local run (train, launcher, run_end), sweeps,
run inspection and plots, the run manifest, and the cluster doctor. Services never import it."""
