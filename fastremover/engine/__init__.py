"""The engine: an EngineConfig resolved against a device and built into the parts the pipeline runs.

    interfaces.py  the contracts: the parallel hook (and SINGLE, the size-1 one the models hold), the denoiser
    build.py       resolve(EngineConfig) -> Plan (device, dtype, mode and fallbacks, attention backend, linear
                   method, check_window); build() -> denoiser, VideoVAE, ResolvedEngine
    denoise.py     the N-step loop, eager or on the fast transformer, replayed as a CUDA graph
    vae.py         VideoVAE (what the pipeline asks of a VAE) and EagerVideoVAE (the eager Wan VAE behind it)
    tiling.py      spatial tiling of VAE calls and the memory model that picks the tiles
    parallel.py    the sequence-parallel denoiser and VAE the build makes for a context of several ranks
"""
