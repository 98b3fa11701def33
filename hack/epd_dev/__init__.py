"""Dev tools of the EPD operator (kubebuilder keeps them in hack/): the local control plane,
the real-vLLM venvs and unit runner, the operator as a process, stand-ins, benchmarks and
`make demo`. Never shipped: the product's wheel and image hold only epd_operator and
epd_client.
"""
