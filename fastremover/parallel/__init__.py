"""Several processes for one clip: sequence-parallel (Ulysses) denoise and a parallel VAE on torch.distributed.

    context.py    ParallelContext: rank, world size, process group, collectives with timeouts, the start-up
                  fingerprint check and the error channel every rank reads (the ParallelHook of a run over ranks)
    ulysses.py    the all-to-all (S/N tokens, all heads) <-> (all tokens, H/N heads) around any attention backend,
                  and the head-count check of a degree
    transport.py  what travels: the activations as they are ("fp16") or e4m3 codes + one fp32 scale per (row, head)
    vae.py        the two encodes on two ranks; the decode split by rows with halo exchanges
    launch.py     `--gpus N` (one process per rank), the torchrun entry, rank 0 driving and the others following
    bench.py      `bench --parallel N` and `info`'s parallel lines

The engine's build wraps the denoiser and the VAE for a context of several ranks (fastremover/engine/parallel.py);
nothing here is imported by the single-process paths (the models' size-1 default hook is
fastremover.engine.interfaces.SINGLE).
See docs/parallel.md.
"""
