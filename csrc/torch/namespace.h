/*
 * The namespace opforge's own ops register under, torch.ops.<OPF_NAMESPACE>.
 * A build parameter (setup.py passes -DOPF_NAMESPACE="acme_ops_1a2b" from
 * OPFORGE_NAMESPACE) because a distribution such as a Hugging Face `kernels`
 * package must ship its ops under a namespace no other package uses; the op
 * names in error messages follow it, so a message names the op as torch does.
 */
#ifndef OPFORGE_TORCH_NAMESPACE_H
#define OPFORGE_TORCH_NAMESPACE_H

#ifndef OPF_NAMESPACE
#define OPF_NAMESPACE "opforge"
#endif

/* "ns::name", the qualified name torch prints, as a string literal */
#define OPF_QUALNAME(name) OPF_NAMESPACE "::" name

#endif
