"""Client–server speculative decoding: the drafter on a client, the target on a server, over HTTP."""
