"""Make GPU-only modules import, fail to import, or be absent, on a CPU machine.

:class:`StubFinder` sits first on ``sys.meta_path`` and answers every import of the top-level
names it is given (``transformer_engine``, ``fused_weight_gradient_mlp_cuda``, ``apex``,
``grouped_gemm``) by their state, whatever is installed:

- ``present``: a catch-all package. Any attribute whose name starts with a capital is a class
  (so megatron-core's ``class TELinear(te.pytorch.Linear)`` and friends define), any other a
  submodule of the same kind (``transformer_engine.pytorch.fp8``); the top module reports
  ``__version__`` (transformer-engine's last release, 2.20.2, unless given). Nothing in it
  computes: it lets megatron-core import and choose its TE code paths, not run them.
- ``absent``: ``ModuleNotFoundError`` naming the module, as for a package that is not installed.
- ``broken``: importing runs and raises: ``OSError`` as when a CUDA library of the wrong
  version is missing (``libcudart.so.12: cannot open shared object file``), or another error
  given as ``broken:ImportError`` (an undefined C++ symbol, an ABI mismatch),
  ``broken:RuntimeError`` or ``broken:ModuleNotFoundError`` (TE without its torch extension).

Every name asked for is recorded in ``requested`` (to prove a package is never imported).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

TE_VERSION = "2.20.2"
_ERRORS = {
    "OSError": lambda name: OSError(
        f"libcudart.so.12: cannot open shared object file: No such file or directory "
        f"(loading {name})"
    ),
    "ImportError": lambda name: ImportError(
        f"{name}: undefined symbol: _ZN3c104cuda9SetDeviceEa (built against another torch)"
    ),
    "RuntimeError": lambda name: RuntimeError(f"{name}: CUDA driver version is insufficient"),
    # TE's core wheel installed without its torch extension (what a failed source build of
    # transformer_engine_torch leaves behind).
    "ModuleNotFoundError": lambda name: ModuleNotFoundError(
        "No module named 'transformer_engine_torch'", name="transformer_engine_torch"
    ),
}


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value = type(name, (), {"__module__": self.__name__, "__init__": _accept_anything})
        else:
            value = importlib.import_module(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _accept_anything(self, *args, **kwargs) -> None:
    pass


class _StubLoader(importlib.abc.Loader):
    def __init__(self, state: str, version: str) -> None:
        self.state, self.version = state, version

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module) -> None:
        if self.state.startswith("broken"):
            kind = self.state.partition(":")[2] or "OSError"
            raise _ERRORS[kind](module.__name__)
        module.__path__ = []  # a package: submodules import through the finder
        if "." not in module.__name__:
            module.__version__ = self.version


class StubFinder(importlib.abc.MetaPathFinder):
    """Serve the top-level names of ``states`` (name -> ``present`` / ``absent`` /
    ``broken[:OSError|ImportError|RuntimeError|ModuleNotFoundError]``) and their submodules."""

    def __init__(self, states: dict[str, str], te_version: str = TE_VERSION) -> None:
        self.states, self.te_version = dict(states), te_version
        self.requested: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        state = self.states.get(fullname.split(".")[0])
        if state is None:
            return None
        self.requested.append(fullname)
        if state == "absent":
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        loader = _StubLoader(state, self.te_version)
        return importlib.machinery.ModuleSpec(fullname, loader, is_package=True)

    def install(self) -> StubFinder:
        """Put the finder first on ``sys.meta_path`` and forget earlier imports of its names."""
        self.forget()
        sys.meta_path.insert(0, self)
        return self

    def uninstall(self) -> None:
        """Remove the finder and the modules it served."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.forget()

    def forget(self) -> None:
        for name in list(sys.modules):
            if name.split(".")[0] in self.states:
                del sys.modules[name]
