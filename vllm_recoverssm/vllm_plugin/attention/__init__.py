"""Attention-side pieces: the recovery KDA backend and its metadata builder."""
