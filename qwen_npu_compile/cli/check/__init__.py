"""The ``qwen-npu-compile check`` harness (the command line itself is :mod:`qwen_npu_compile.cli`).

* :mod:`.models` -- the presets (published configs) and local model directories ``check`` builds, the
  memory estimate, and the one tiny Qwen2 of the tests, examples and quick benchmarks;
* :mod:`.spec` -- :class:`~.spec.CheckSpec`, what one run is asked to do (the ``check`` flags as typed fields)
  and the clashes of flags it refuses before anything is built;
* :mod:`.harness` -- :func:`~.harness.run_check` (build, eager / fp32 reference / compiled runs,
  expected fusion counts, the results dict) and :func:`~.harness.run_model`, the one forward/backward step;
* :mod:`.parity` -- the one definition of parity with eager (relative L2; fp32 bounds, half precision
  against an fp32 reference), used by ``check`` and the tests;
* :mod:`.table` -- the printed table and GE conversion lines.
"""
