"""The benchmark suites: each module has TITLE, DEFAULTS (the shared options it takes), options() and run()."""
