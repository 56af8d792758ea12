"""The OpenAI Batch API: files, batches whose lines run as tasks through the scheduler."""
