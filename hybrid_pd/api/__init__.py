"""What the proxy and the workers share, with no torch and no engine code: sampling
parameters and their checks, the tokenizer wrapper, the model card, and their wire forms."""
