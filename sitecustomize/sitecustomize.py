"""pdpatch's PYTHONPATH activation: ``PYTHONPATH=<this dir> vllm serve ...`` (or ``pdpatch-run``).

It arms pdpatch's ``vllm`` import hook, then chains to any other ``sitecustomize`` further on
the path (a user's, ddtrace's, opentelemetry's), exactly as if this one were not there.
"""

import importlib.util
import os
import sys


def _pdpatch_bootstrap():
    here = os.path.dirname(os.path.abspath(__file__))
    if importlib.util.find_spec("pdpatch") is None:
        # A checkout used without installing: the package sits next to this directory.
        sys.path.append(os.path.dirname(here))
    try:
        import pdpatch.bootstrap.autoload as autoload

        autoload.init()
    except Exception as exc:
        print(f"pdpatch sitecustomize: not activated: {exc!r}", file=sys.stderr)

    # Chain: hide this module and this directory, import the next sitecustomize, then put this
    # directory back where it was -- keeping whatever the next one changed in sys.path (kvcached's,
    # for one, adds its site directory there).
    me = sys.modules.pop("sitecustomize", None)
    hidden = [(i, p) for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == here]
    for i, _ in reversed(hidden):
        del sys.path[i]
    try:
        if importlib.util.find_spec("sitecustomize") is not None:
            import sitecustomize  # noqa: F401
    except Exception as exc:
        print(f"pdpatch sitecustomize: the next sitecustomize failed: {exc!r}", file=sys.stderr)
    finally:
        for i, p in hidden:
            sys.path.insert(i, p)
        if me is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = me


_pdpatch_bootstrap()
del _pdpatch_bootstrap
