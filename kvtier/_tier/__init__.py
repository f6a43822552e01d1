"""The tier engine under both shells (manager.py, vllm.py): private."""
