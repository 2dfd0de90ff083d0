"""Several processes: parallel modes and rank agreement (``parallel``), fully_shard's
parameter layout (``sharding``), checkpoints through DCP (``checkpoint``,
``checkpoint_check``) and load-balanced samplers (``data``)."""
