"""Training of the small GPT-OSS target and its EAGLE-3 draft, and their offline data."""
