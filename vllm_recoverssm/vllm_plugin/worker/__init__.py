"""Worker-side pieces: the GPU model runner (V2) model state that commits, then captures."""
