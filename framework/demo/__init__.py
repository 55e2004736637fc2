"""Support for running txbox daemons as real processes: the demo, benchmarks, acceptance tests."""
