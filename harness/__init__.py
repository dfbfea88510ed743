"""What the tests and the benchmarks both start and talk to: free ports, server processes, vLLM instances, pipes.

Not part of the product (setup.py does not install it): both tests/ and benchmarks/ import it from the checkout.
"""
