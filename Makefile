# Developer shortcuts. `make test` is the README's test command; `make bench` reruns the performance
# evidence (docs/performance.md) and writes benchmarks/results/*.json and summary.md.
PYTHON ?= python
BENCH_OUT ?= benchmarks/results
BENCH_QUICK_OUT ?= /tmp/qwen_npu_bench_quick

.PHONY: test bench bench-quick

test:
	$(PYTHON) -m pytest -q -n 2 --dist loadfile

bench:
	$(PYTHON) -m benchmarks.run --out $(BENCH_OUT)

# Tiny shapes, one repeat: a smoke run in seconds (what tests/benchmarks/test_benchmarks.py checks).
bench-quick:
	$(PYTHON) -m benchmarks.run --quick --out $(BENCH_QUICK_OUT)
