"""The network: the decoder, its fused log-probs, and its HF checkpoints in and out."""
