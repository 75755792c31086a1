# Group load share per training step: one panel per MoE layer, a line per
# expert group: its share of the layer's routed tokens (solid) and of the
# router's probability mass, the soft load (thin, dashed); grey dashes = 1/M.
# Set by himoe-plot: out, format, datadir, run_name, N, M, L, ymax.
cols = L < 2 ? 1 : (L < 5 ? 2 : 4)
rows = (L + cols - 1) / cols
W = 900
H = rows == 1 ? 500 : 260 + 230 * rows
if (format eq 'svg') {
  set terminal svg size W,H dynamic enhanced font 'sans,11' background rgb 'white'
} else {
  set terminal pngcairo size W,H enhanced font 'sans,10'
}
set output out

set yrange [0:ymax]
set ytics format '%.2f'
set grid ytics lc rgb '#dddddd'
set tics out nomirror
set autoscale xfix
set style line 100 lc rgb '#444444' dt 2 lw 1
array colours[8] = ['#1b9e77', '#d95f02', '#7570b3', '#e7298a', '#66a61e', '#e6ab02', '#a6761d', '#666666']

# One legend row under the page title (a key would be squeezed into a panel):
# a 0.03-wide line sample, then its text (~0.0064 of the width per character).
unset key
items = M + 2
array texts[items]
do for [i=1:M] { texts[i] = sprintf('group %d', i - 1) }
texts[M + 1] = 'router probability (soft load)'
texts[M + 2] = sprintf('1/%d', M)
item_w(i) = 0.06 + 0.0064 * strlen(texts[i])
total = 0
do for [i=1:items] { total = total + item_w(i) }
x = 0.5 - total / 2
ky = 1 - 48.0 / H
do for [i=1:items] {
  if (i <= M) {
    set arrow from screen x, screen ky to screen x + 0.03, screen ky nohead lw 1.5 lc rgb colours[(i - 1) % 8 + 1]
  } else {
    if (i == M + 1) {
      set arrow from screen x, screen ky to screen x + 0.03, screen ky nohead lw 1 dt 2 lc rgb '#000000'
    } else {
      set arrow from screen x, screen ky to screen x + 0.03, screen ky nohead ls 100
    }
  }
  set label texts[i] at screen x + 0.036, screen ky left font ',9'
  x = x + item_w(i)
}

set multiplot layout rows, cols title sprintf('Group load share per step (%s, %d groups of %d experts)', run_name, M, N / M) font ',13' noenhanced \
    margins 0.08, 0.98, 60.0 / H, 1 - 85.0 / H spacing 0.07, 0.11
do for [l=0:L-1] {
  set title sprintf('layer %d', l) offset 0,-0.6
  set xlabel (l >= L - cols ? 'training step' : '') offset 0,0.5
  set ylabel (l % cols == 0 ? 'share of tokens' : '')
  file = sprintf('%s/group_share_layer%d.dat', datadir, l)
  plot for [g=0:M-1] file using 1:(column(g + 2)) skip 1 \
         with lines lw 1.5 lc rgb colours[g % 8 + 1] notitle, \
       for [g=0:M-1] file using 1:(column(M + g + 2)) skip 1 \
         with lines lw 1 dt 2 lc rgb colours[g % 8 + 1] notitle, \
       1.0 / M with lines ls 100 notitle
  unset arrow  # the legend is drawn once
  unset label
}
unset multiplot
