"""Stubs that let the released Hi-MoE code (brain-lab-research/Hi-MoE) import on
Debian's python3-torch 1.13 without its optional extras. Put this folder on
PYTHONPATH. Each stub is used ONLY when the real module cannot be found
(the finder is appended after the normal ones), and modules are only created
when imported, so nothing is loaded at interpreter start.

  torch._dynamo       (torch >= 2.0): `disable` is an identity decorator,
                      `config` a namespace; train.py sets config.suppress_errors.
  matplotlib[.pyplot], seaborn: imported at the top of utils/expert_tracker.py
                      for heat-map plots (never drawn with track_expert_activations=False).
  wandb:              only imported when wandb_log=True (we pass False).
"""
import importlib.abc
import importlib.machinery
import sys
import types

_STUBS = {'torch._dynamo', 'matplotlib', 'matplotlib.pyplot', 'seaborn', 'wandb'}


class _Anything(types.ModuleType):
    """A module whose unknown attributes are no-op callables."""
    def __getattr__(self, name):
        if name.startswith('__'):
            raise AttributeError(name)
        def _noop(*a, **k):
            return None
        return _noop


def _identity_decorator(fn=None, *a, **k):
    if fn is None or not callable(fn):
        return lambda f: f
    return fn


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        if spec.name == 'torch._dynamo':
            m = types.ModuleType(spec.name)
            m.disable = _identity_decorator
            m.config = types.SimpleNamespace(suppress_errors=True, cache_size_limit=8)
            m.reset = lambda: None
            m.__himoe_stub__ = True
            return m
        m = _Anything(spec.name)
        m.__himoe_stub__ = True
        if spec.name == 'matplotlib':
            m.__path__ = []  # a package, so matplotlib.pyplot resolves
        return m

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in _STUBS:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(),
                                                  is_package=(fullname == 'matplotlib'))
        return None


sys.meta_path.append(_StubFinder())
