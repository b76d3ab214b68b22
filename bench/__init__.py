"""The benchmarks behind BENCHMARKS.md (bench/README.md lists them). A package only so that
`bench.common` (the shapes, the offline environment, the report writer) is importable by the
correctness checks in checks/; the benchmarks themselves run as scripts."""
