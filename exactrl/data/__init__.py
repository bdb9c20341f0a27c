"""Data: JSONL reading with file:line errors, encoding (chat templates, loss masks), the typed batch, batching."""
