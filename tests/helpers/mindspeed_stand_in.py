"""A stand-in ``mindspeed`` package (MindSpeed is not installable here), for tests/integrations/test_mindspeed.py and the
verl engine runs of tests/integrations/test_verl_hook.py.

Its ``mindspeed.megatron_adaptor`` import registers ``dummy_compile`` for ``torch.compile`` (and
``torch.jit.script``) with a patch manager shaped like MindSpeed's (``mindspeed/patch_utils.py``:
``MindSpeedPatchesManager.patches_info[name]`` is a ``Patch`` whose ``apply_patch`` records the original as
``orig_func`` and replaces it in its module and in every module attribute of that name that held it;
``mindspeed/core/megatron_basic/requirements_basic.py``: ``dummy_compile`` returns a wrapper that calls the
function uncompiled).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

DUMMY = "mindspeed.core.megatron_basic.requirements_basic.dummy_compile"

STAND_IN = {
    "mindspeed/__init__.py": "",
    "mindspeed/core/__init__.py": "",
    "mindspeed/core/megatron_basic/__init__.py": "",
    "mindspeed/core/megatron_basic/requirements_basic.py": '''
        def dummy_compile(*args, **kwargs):
            """MindSpeed's stand-in for torch.compile: the function, run uncompiled."""
            if args and callable(args[0]):
                def wrapper(*fn_args, **fn_kwargs):
                    return args[0](*fn_args, **fn_kwargs)
                return wrapper

            def compile_wrapper(fn):
                def wrapper(*fn_args, **fn_kwargs):
                    return fn(*fn_args, **fn_kwargs)
                return wrapper
            return compile_wrapper
        ''',
    "mindspeed/patch_utils.py": '''
        import importlib
        import sys


        class Patch:
            def __init__(self, orig_func_name, new_func):
                self.orig_module_name, self.orig_func_name = orig_func_name.rsplit(".", 1)
                self.orig_module = None
                self.orig_func = None
                self.patch_func = new_func
                self.final_patch_func = None
                self.is_applied = False

            def apply_patch(self):
                if self.is_applied:
                    return
                module = importlib.import_module(self.orig_module_name)
                current = getattr(module, self.orig_func_name)
                if self.orig_module is None:
                    self.orig_module, self.orig_func = module, current
                setattr(self.orig_module, self.orig_func_name, self.patch_func)
                # every module attribute of that name that held it; MindSpeed's hasattr() on each module would
                # import transformers' lazy submodules (aria needs torchvision, absent in verl's CPU venv): the
                # module __dict__ holds the same bindings without triggering a module __getattr__
                for value in list(sys.modules.values()):
                    if getattr(value, "__dict__", {}).get(self.orig_func_name) is current:
                        setattr(value, self.orig_func_name, self.patch_func)
                self.final_patch_func = self.patch_func
                self.is_applied = True

            def remove_patch(self):
                for key, value in list(sys.modules.items()):
                    if "mindspeed" not in key and getattr(value, self.orig_func_name, None) is self.final_patch_func:
                        setattr(value, self.orig_func_name, self.orig_func)
                self.patch_func = self.final_patch_func = None
                self.is_applied = False


        class MindSpeedPatchesManager:
            patches_info = {}

            @staticmethod
            def register_patch(orig_func_name, new_func=None):
                MindSpeedPatchesManager.patches_info[orig_func_name] = Patch(orig_func_name, new_func)

            @staticmethod
            def apply_patches():
                for patch in MindSpeedPatchesManager.patches_info.values():
                    patch.apply_patch()
        ''',
    "mindspeed/megatron_adaptor.py": '''
        from mindspeed.core.megatron_basic.requirements_basic import dummy_compile
        from mindspeed.patch_utils import MindSpeedPatchesManager as pm

        pm.register_patch("torch.compile", dummy_compile)
        pm.register_patch("torch.jit.script", dummy_compile)
        pm.apply_patches()
        ''',
}



def write_stand_in(folder: Path) -> Path:
    """Write the stand-in package under ``folder`` (put ``folder`` on ``sys.path`` / ``PYTHONPATH``); returns it."""
    for relative, source in STAND_IN.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return folder
