"""Training TaperNorm / DyT decoders (docs/training.md).

    train.presets      presets (baseline, internal-taper, all-taper, all-taper-noanchor, dyt) and sizes
    train.config       TrainConfig: one run, resolved and checked (torch-free, for fast errors)
    train.schedule     the gate schedule (warmup at 1, cosine to exactly 0) and the lr schedule
    train.calibration  least-squares c of every TaperNorm at the end of warmup
    train.scale_loss   the fixed-target scale loss of All-Taper
    train.loop         the training loop, evaluation, atomic checkpoints and the JSON log
    train.distributed  torchrun / DistributedDataParallel: the process group and the collectives
    train.shards       token shards: a corpus tokenized once into memory-mapped files (--data)
    train.interrupts   a Ctrl-C that an import drops still stops a train command
    train.corpus       the deterministic story generator, local files, TinyStories via `datasets`
    train.tokenizer    the byte-level BPE tokenizer (train/data/tokenizer.json)
    train.screen_dyt   the DyT saturation screen
    train.report       results table, logit-chasing figure, zoo install

    python -m train --preset P --size S --out DIR
"""
