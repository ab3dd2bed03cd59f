"""``python -m qwen_npu_compile``: the ``qwen-npu-compile`` command (:func:`qwen_npu_compile.cli.main`)."""

import sys

from .cli import main

sys.exit(main())
