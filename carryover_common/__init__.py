"""What every layer above the model shares: command-line parsing (`cli`), target loading (`targets`) and benchmark
prompts (`benchmarks`). It imports only `modeling_carryover` and third-party packages, so trainer/, evaluation/, hub/
and serving/ all import it without reaching into each other."""
