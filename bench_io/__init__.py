"""bench_io: checkpoint IO throughput (ucp against raw IO, torch.save, safetensors) on tmpfs and disk; see __main__."""
