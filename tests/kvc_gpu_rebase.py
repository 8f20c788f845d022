"""GPU check of pdpatch num_blocks' bounded-storage re-basing (the CUDA path of
``_bounded_bytes``): run on a machine with a GPU, from the
checkout root: ``python -m tests.kvc_gpu_rebase``.

CPU CI covers the numpy path; this covers ``__cuda_array_interface__``: the re-based views alias
the original memory (no copy), their storage spans exactly the planned bytes, writes through them
land in the original allocation, and the original allocation stays alive as long as they do
(also after every other reference to it is dropped).  Prints one JSON line.
"""

from __future__ import annotations

import gc
import json

import torch

from pdpatch.patches.num_blocks import wrappers as nb


def main() -> dict:
    dev = torch.device("cuda")
    L, H, bs, C, planned, virtual = 4, 8, 16, 256, 1000, 4771
    page = H * bs * C
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    # kvcached's contiguous layout: one reservation, block b of layer l at (b * L + l) * page
    raw = torch.randn(virtual * L * page + 4096, device=dev, dtype=torch.bfloat16)
    views = {f"l{i}": torch.as_strided(raw, (virtual, H, bs, C), (L * page, bs * C, C, 1),
                                       i * page) for i in range(L)}
    sliced = {k: v.narrow(0, 0, planned) for k, v in views.items()}
    rebased = nb._rebased(sliced, list(sliced))
    isz = raw.element_size()
    storages = {t.untyped_storage().data_ptr() for t in rebased.values()}
    out["one_shared_storage"] = len(storages) == 1
    out["storage_bytes"] = next(iter(rebased.values())).untyped_storage().nbytes()
    out["expected_bytes"] = planned * L * page * isz
    out["original_bytes"] = raw.untyped_storage().nbytes()
    out["aliases"] = all(rebased[k].data_ptr() == sliced[k].data_ptr() for k in sliced)
    out["same_values"] = all(torch.equal(rebased[k], sliced[k]) for k in sliced)
    rebased["l2"][planned - 1].fill_(7.0)
    torch.cuda.synchronize()
    out["write_lands"] = bool((views["l2"][planned - 1] == 7.0).all())
    expect = views["l3"][17].clone()
    del raw, views, sliced
    gc.collect()
    torch.cuda.empty_cache()
    filler = torch.zeros(virtual * L * page, device=dev, dtype=torch.bfloat16)  # reuse attempt
    torch.cuda.synchronize()
    out["outlives_owner"] = bool(torch.equal(rebased["l3"][17], expect))
    del filler
    out["ok"] = (out["one_shared_storage"] and out["storage_bytes"] == out["expected_bytes"]
                 and out["aliases"] and out["same_values"] and out["write_lands"]
                 and out["outlives_owner"])
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
