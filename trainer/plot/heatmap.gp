# Expert activation heatmaps (the paper's Figure 5 layout): one panel per MoE
# layer, experts on x (grouped, groups split by white lines), training steps on
# y (downwards), colour = the expert's share of the layer's routed tokens in
# that step (or bin of steps); white is the uniform share 1/N.
# Set by himoe-plot: out, format, datadir, run_name, N, M, first_layer,
# last_layer, cbmax, y_first, y_last (the steps' range), bin_steps (steps per
# row: the data's rows hold counts summed over that many steps).
panels = last_layer - first_layer + 1
cols = panels < 4 ? panels : 4
rows = (panels + cols - 1) / cols
W = panels == 1 ? 700 : 900
H = 260 + 240 * rows
if (format eq 'svg') {
  set terminal svg size W,H dynamic enhanced font 'sans,11' background rgb 'white'
} else {
  set terminal pngcairo size W,H enhanced font 'sans,10'
}
set output out

uniform = 1.0 / N
set palette defined (0 '#08306b', 0.5 * uniform '#6baed6', uniform '#f7f7f7', \
                     0.5 * (uniform + cbmax) '#fb6a4a', cbmax '#67000d')
set cbrange [0:cbmax]
set cbtics format '%.2f'
set cblabel sprintf('share of routed tokens (white = 1/%d)', N) offset 1,0

set yrange [y_last:y_first]
set xrange [-0.5:N - 0.5]
set xtics 1 scale 0 font ',9'
if (N > 16) { set xtics N / 16 }
per_group = N / M
if (M <= 16 && M > 1) {
  set x2range [-0.5:N - 0.5]
  set x2tics scale 0 font ',9' ()
  do for [g=0:M-1] { set x2tics add (sprintf('G%d', g) g * per_group + (per_group - 1) / 2.0) }
}
unset key
set tics out nomirror

title = panels == 1 ? sprintf('Expert activation, MoE layer %d (%s)', first_layer, run_name) \
                    : sprintf('Expert activation per MoE layer (%s)', run_name)
# Margins in screen coordinates: a shared colour box on the right.
L0 = panels == 1 ? 0.12 : 0.08; R0 = 0.86; T0 = 1 - 60.0 / H; B0 = 55.0 / H
pw = (R0 - L0) / cols; ph = (T0 - B0) / rows; gap = 0.012

set multiplot title title font ',13' noenhanced
do for [i=0:panels-1] {
  l = first_layer + i
  c = i % cols; r = i / cols
  set lmargin at screen L0 + c * pw + (c == 0 ? 0 : 3 * gap)
  set rmargin at screen L0 + (c + 1) * pw - gap
  set tmargin at screen T0 - r * ph - (panels == 1 ? 0.02 : 0.045)
  set bmargin at screen T0 - (r + 1) * ph + 0.05
  set title sprintf('layer %d', l) offset 0,-0.6
  if (panels == 1) { unset title }
  set xlabel 'expert' offset 0,0.6
  if (c == 0) {
    set ylabel (bin_steps > 1 ? sprintf('training step (rows of %d steps)', bin_steps) : 'training step')
  } else {
    unset ylabel
  }
  if (i == panels - 1) {
    set colorbox user origin screen R0 + 0.02, screen B0 + 0.05 size screen 0.02, screen T0 - B0 - 0.1
  } else {
    unset colorbox
  }
  unset arrow
  do for [g=1:M-1] {
    set arrow from g * per_group - 0.5, graph 0 to g * per_group - 0.5, graph 1 nohead front lc rgb 'white' lw 2
  }
  plot sprintf('%s/heatmap_layer%d.dat', datadir, l) using 2:1:3 skip 1 with image
}
unset multiplot
