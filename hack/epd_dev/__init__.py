"""Dev tools of the EPD operator (kubebuilder keeps them in hack/): the local control plane and
its real node, the node's images, the real-vLLM venvs, the operator as a process and as a Helm
release, stand-ins, benchmarks and `make demo`. Never shipped: the product's wheel and image hold only epd_operator and
epd_client.
"""
