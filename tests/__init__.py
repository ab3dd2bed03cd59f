"""The tests of qwen_npu_compile; the helpers they share are :mod:`tests.helpers`."""
