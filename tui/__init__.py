"""The textual chat app (edge/ never imports textual)."""
