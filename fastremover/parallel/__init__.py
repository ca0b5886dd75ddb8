"""Several processes for one clip: sequence-parallel (Ulysses) denoise and a parallel VAE on torch.distributed.

    context.py    ParallelContext: rank, world size, process group (size 1 by default), collectives with timeouts,
                  the start-up fingerprint check and the error channel every rank reads
    ulysses.py    the all-to-all (S/N tokens, all heads) <-> (all tokens, H/N heads) around any attention backend
    transport.py  what travels: the activations as they are ("fp16") or e4m3 codes + one fp32 scale per (row, head)
    vae.py        the two encodes on two ranks; the decode split by rows with halo exchanges
    engine.py     the sequence-parallel denoiser and VAE the engine's build makes for a context of several ranks
    launch.py     `--gpus N` (one process per rank), the torchrun entry, rank 0 driving and the others following
    bench.py      `bench --parallel N` and `info`'s parallel lines

Nothing here is imported by the single-process paths except `context.SINGLE` (the size-1 default the models hold).
See docs/parallel.md.
"""
