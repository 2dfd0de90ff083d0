"""Other libraries' configurations, read into spmd_ort's own: DeepSpeed (``deepspeed``)."""
