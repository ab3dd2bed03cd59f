"""``python -m qwen_npu_compile``: the ``qwen-npu-compile`` command (:func:`qwen_npu_compile.cli.main`)."""

import sys

from qwen_npu_compile.cli import main

sys.exit(main())
