"""The brief's walk-through (section 2.3) on the CPU, end to end:
call the C op like a torch function, check it against the PyTorch reference,
then backward, autocast, torch.compile, and a short speed table."""

import time

import torch

import opforge
from opforge.benchmark import measure, ratio_text  # interleaved medians, until their spread is small


def pytorch_reference(input_tensor, alpha):
    return input_tensor * alpha + torch.sqrt(input_tensor)


def main():
    torch.manual_seed(0)
    print(f"opforge {opforge.__version__} on torch {torch.__version__}; kernels: {opforge.get_isa()}, "
          f"{torch.get_num_threads()} threads\n")

    # 1. the op, as in the brief (a (32, 512) input; torch.rand: sqrt needs x >= 0)
    batch_size, seq_len, alpha = 32, 512, 0.8
    input_tensor = torch.rand(batch_size, seq_len, dtype=torch.float32)
    output_tensor = opforge.dispersion_correction(input_tensor, alpha)
    ref_output = pytorch_reference(input_tensor, alpha)
    print("1. forward")
    print(f"   mean |opforge - reference|: {torch.mean(torch.abs(output_tensor - ref_output)).item():.3e}")
    print(f"   output device: {output_tensor.device}, dtype {output_tensor.dtype}, shape {tuple(output_tensor.shape)}")

    # 2. backward against autograd of the reference
    x = input_tensor.clone().requires_grad_()
    xr = input_tensor.clone().requires_grad_()
    grad = torch.randn_like(input_tensor)
    opforge.dispersion_correction(x, alpha).backward(grad)
    pytorch_reference(xr, alpha).backward(grad)
    print("2. backward")
    print(f"   max |dx - autograd dx| / max |dx|: {((x.grad - xr.grad).abs().max() / xr.grad.abs().max()).item():.3e}")

    # 3. mixed precision: under autocast the op follows its input, as eager x * alpha + sqrt(x) does: a
    #    bfloat16 tensor (a lowered matmul's output) runs in bfloat16 (fp32 math inside)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = opforge.dispersion_correction(input_tensor.bfloat16(), alpha)
    err16 = (y16.double() - pytorch_reference(input_tensor.double(), alpha)).abs().max().item()
    print("3. torch.autocast('cpu', dtype=torch.bfloat16)")
    print(f"   output dtype {y16.dtype}, max error against float64: {err16:.3e} (input and output rounded to bfloat16)")

    # 4. torch.compile(fullgraph=True): the op is a graph node, no graph break
    @torch.compile(fullgraph=True)
    def layer(t):
        return torch.tanh(opforge.dispersion_correction(t, alpha)) * 2

    t0 = time.perf_counter()
    yc = layer(input_tensor)
    print("4. torch.compile(fullgraph=True)")
    print(f"   compiled in {time.perf_counter() - t0:.1f} s, max |compiled - eager reference|: "
          f"{(yc - torch.tanh(ref_output) * 2).abs().max().item():.3e}")

    # 5. speed: opforge against eager and torch.compile of the reference
    compiled_ref = torch.compile(pytorch_reference, dynamic=False)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    print("5. speed (median of interleaved runs, more rounds until each side's middle half is within "
          "25%; >1 means opforge is faster; in brackets, the ratio of the quartiles' extremes)\n")
    print("   | elements | vs eager | vs torch.compile |")
    print("   |---:|---:|---:|")
    for n in (batch_size * seq_len, 1 << 20, 1 << 24):
        t = torch.rand(n) + 0.01
        m = measure(
            {
                "opforge": lambda: opforge.dispersion_correction(t, alpha),
                "eager": lambda: pytorch_reference(t, alpha),
                "compile": lambda: compiled_ref(t, alpha),
            },
            reps=5,
            target_s=0.03,
        )
        print(f"   | {n:,} | {ratio_text(m['eager'], m['opforge'])} | {ratio_text(m['compile'], m['opforge'])} |")
    print("\nFull sweep: make bench (CSV, markdown and PNG under benchmarks/results/).")


if __name__ == "__main__":
    main()
