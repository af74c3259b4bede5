"""The operations layer: one module per noun (ingest, rubric, judge, credit, audit, evaluate,
replay, run). Each operation reads its inputs, calls the pure functions of the library and
publishes its outputs as one set; the CLI commands and the Python API are thin layers over it."""
