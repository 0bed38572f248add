// A float32 linear layer over a batch of rows on a weight packed in panels: y = x W^T + b.
//
// A batched decode step (tens of rows) is neither bound by reading the weights nor by the
// arithmetic alone: aten's and oneDNN's GEMMs there ran well below both ceilings, a weight
// streamed from memory and then computed on, one after the other (docs/cpu.md has the figures).
// Here the weight is packed once into panels of kPanel output features, [panels, in, kPanel]:
// a panel's column k is the kPanel weights that multiply input feature k, one contiguous run.
// A task takes a panel and a block of up to kTileRows rows and keeps the block's kPanel outputs
// in registers (AVX-512: 2 vectors a row; AVX2: half a panel at a time), adding one input
// feature after the other, each a broadcast of x times a column; the other row blocks reread
// the panel from L2 while the task asks for the next panel's lines, so the memory reads run
// under the arithmetic. Every output is the same chain of fused multiply-adds over k in order,
// whatever block, thread or batch its row falls in: a row's outputs do not depend on the rows
// beside it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "panel_tile.h"

namespace {

using namespace contbatch_panel;

// [out, in] float32 -> [ceil(out / kPanel), in, kPanel], the last panel's missing outputs zero.
at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "panel_pack: a 2-D float32 CPU weight, got ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), in = w.size(1), panels = (out + kPanel - 1) / kPanel;
  at::Tensor packed = at::empty({panels, in, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, out - p * kPanel);
      for (int64_t i = 0; i < in; ++i) {
        float* column = dst + (p * in + i) * kPanel;
        for (int64_t o = 0; o < cols; ++o) column[o] = src[(p * kPanel + o) * in + i];
        std::fill(column + cols, column + kPanel, 0.f);
      }
    }
  });
  return packed;
}

// x [..., in] float32; weight [out, in] float32 and `packed` its panel_pack. Up to kPanelMaxRows rows
// the rows split into blocks of equal size (at most kTileRows), the work into (panel, block)
// units, panel after panel: a thread's units of a panel share it, and ask for the next one. More
// rows (prompt chunks: compute-bound, where aten's GEMM with its own packing measured faster,
// docs/cpu.md) take aten's linear on the plain weight.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  packed.scalar_type() == at::kFloat && x.device().is_cpu(),
              "panel_linear: float32 CPU input and weights");
  const int64_t in = x.size(-1), out_features = weight.size(0), panels = packed.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == in && packed.dim() == 3 && packed.size(1) == in &&
                  packed.size(2) == kPanel && packed.is_contiguous() && (out_features + kPanel - 1) / kPanel == panels,
              "panel_linear: a weight of ", in, " inputs and its panel_pack, got ", weight.sizes(), " and ",
              packed.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == out_features &&
                                    bias->is_contiguous()),
              "panel_linear: a contiguous float32 bias of ", out_features);
  const int64_t m = in == 0 ? 0 : x.numel() / in;
  if (m > kPanelMaxRows || in == 0) return at::linear(x, weight, bias);
  const at::Tensor rows = x.reshape({m, in}).contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  at::Tensor y = at::empty({m, out_features}, x.options());
  if (m == 0) return y.view(shape);
  const int64_t blocks = (m + kTileRows - 1) / kTileRows, base = m / blocks, extra = m % blocks;
  const int64_t lines = in * kPanel * static_cast<int64_t>(sizeof(float)) / 64;
  const float* xp = rows.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end;) {
      const int64_t p = u / blocks, jb = u % blocks, je = std::min(blocks, jb + end - u);
      const float* panel = pp + p * in * kPanel;
      // The next panel's lines, a share for each of this thread's blocks of this panel.
      const int64_t share = p + 1 < panels ? (lines + je - jb - 1) / (je - jb) : 0;
      for (int64_t j = jb; j < je; ++j) {
        const int64_t r0 = j * base + std::min(j, extra), count = base + (j < extra);
        const int64_t first = (j - jb) * share, ask = std::max<int64_t>(0, std::min(share, lines - first));
        const Ahead ahead{reinterpret_cast<const char*>(panel + in * kPanel) + first * 64, ask, (ask + in - 1) / in};
        kTiles[count - 1](xp + r0 * in, in, panel, in, bp ? bp + p * kPanel : nullptr,
                          yp + r0 * out_features + p * kPanel, out_features, std::min(kPanel, out_features - p * kPanel),
                          ahead);
      }
      u += je - jb;
    }
  });
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.def("panel_pack(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) {
  m.impl("panel_pack", panel_pack);
  m.impl("panel_linear", panel_linear);
}
