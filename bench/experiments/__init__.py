"""One module per experiment; each runs end to end with one command:
`python -m pegaflow.bench.experiments.<name> --out bench/results`."""
