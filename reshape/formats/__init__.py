"""Import and export formats: Hugging Face transformers (hf.py) and torch.distributed.checkpoint
(dcp.py); reference.py holds what they share."""
