"""KV over real NIXL between two processes: fused<->fused, split->fused, fused->split, planned by
pdpatch's own code (the PairPlan tables and desc ids the patches use inside vLLM), on GPU
(cudaMalloc pools and real kvcached VMM pools) or on host memory (``--device cpu``, what CI runs).

Per block size (16-256 KiB per [K|V] block) and request pattern (scattered blocks, runs of 4/16
consecutive blocks) it times, against the fused path of the same run:

* ``fused<-fused merged``  -- the fused path: ids ordered by local address so NIXL merges every
  run (one descriptor per run and layer); the baseline of every ratio;
* ``... vllm-ids``         -- the desc ids exactly as vLLM orders them (region-major);
* ``split->fused`` / ``fused->split`` with ``vllm-ids`` (what the conversion patch does now: one
  descriptor per block segment), ``merged`` (NIXL merging can do nothing here) and ``staged``
  (``stage`` of lab/kv_reference.py: transfer into a staging buffer in remote order, so
  remote-contiguous runs are one descriptor, then one local copy kernel);

with bytes checked exactly after every repetition (independent oracle: logical K/V views of the
allocator's own tensors, seeded content regenerated on the other side; untouched blocks must
keep their poison), NIXL's ``descCount``, GB/s, and a plain device copy of the same bytes.
It also proves the kvcached registration policy (registration sliced to the planned blocks: a
descriptor past the plan fails that request with NIXL_ERR_NOT_FOUND, the peer lives on, while a
whole-storage registration silently reads zero-page bytes) and records what
:mod:`pdpatch.transport` says about each pool.

Run from the checkout root on the GPU machine: ``python3 -m scripts.gpu_kv_bench --device cuda
--json out.json``; on CPU: ``.venv/bin/python -m scripts.gpu_kv_bench --device cpu --quick``.

The modules, in the order a run meets them: :mod:`.cli` (options, sections, report),
:mod:`.pools` (each side's memory and the byte oracle), :mod:`.peer` (the remote process),
:mod:`.agents` (NIXL agent helpers), :mod:`.initiator` (the local side and one transfer timed in
each form), :mod:`.copier` (the CuPy copy kernel), :mod:`.cases` (the modes measured),
:mod:`.checks` (registration policy, transport findings), :mod:`.report` (what is printed).
The peers are spawned processes: they import ``lab.gpu_bench`` on the path they inherit.
"""
