"""The modules of dflash-train beside its two main files (train_dflash_pipeline.py, the trainer;
dflash_model.py, the drafter): the command line and settings, the data, the target stage, the
memory plan, checkpoints, kernels, decoding, evaluation, regeneration and their helpers.
docs/architecture.md draws how they fit together."""

__version__ = "0.9.0"  # recorded in every checkpoint it writes (checkpoints.CHECKPOINT_FORMAT)
