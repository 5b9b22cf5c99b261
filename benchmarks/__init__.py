"""specchat's benchmark tool (`python -m benchmarks`): the harness, the suites, the GPU check."""
