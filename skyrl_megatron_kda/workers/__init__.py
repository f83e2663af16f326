"""Ray actors that each own one torch.distributed rank."""
