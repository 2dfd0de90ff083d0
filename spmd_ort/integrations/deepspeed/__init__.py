"""DeepSpeed configs as they are written: ``config`` (JSON -> DataParallel settings),
``plan`` (:func:`spmd_ort.from_deepspeed_config` -> :class:`DeepSpeedPlan`) and
``schedules`` (DeepSpeed's LR schedules as torch schedulers)."""
