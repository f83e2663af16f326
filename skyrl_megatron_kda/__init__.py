"""SkyRL training-backend plugin: GLM-5.3-Flash KDA linear attention on Megatron-Core with context parallelism."""
