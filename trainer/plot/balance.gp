# Balance inside the groups, per MoE layer over training (a line per layer;
# points: the same quantity over the validation set at each evaluation):
#   1. the top expert's share of its group's assignments, mean over groups
#      (1/S = balanced, 1 = one expert takes the whole group: collapse);
#   2. the entropy of the expert load divided by log N (1 = uniform);
#   3. mean ||pi||^2 of the router's (corrected) probabilities (1/N = uniform
#      router, 1 = one-hot: what R_intra rewards);
#   4. (when the balance controller is on) its selection bias per expert at the
#      last step, a line per layer; white lines split the groups.
# Set by himoe-plot: out, format, datadir, run_name, N, M, L, has_eval,
# has_bias, bias_step, x_first, x_last.
panels = 3 + has_bias
W = 900
H = 150 + 230 * panels
if (format eq 'svg') {
  set terminal svg size W,H dynamic enhanced font 'sans,11' background rgb 'white'
} else {
  set terminal pngcairo size W,H enhanced font 'sans,10'
}
set output out
data = sprintf('%s/balance.dat', datadir)
evals = sprintf('%s/balance_eval.dat', datadir)
S = N / M

set tics out nomirror
set grid ytics lc rgb '#dddddd'
set style line 100 lc rgb '#444444' dt 2 lw 1
array colours[8] = ['#1b9e77', '#d95f02', '#7570b3', '#e7298a', '#66a61e', '#e6ab02', '#a6761d', '#666666']
colour(l) = colours[l % 8 + 1]

# One legend row under the page title: a line sample per layer, then the
# validation marker.
unset key
items = L + has_eval
array texts[items]
do for [i=1:L] { texts[i] = sprintf('layer %d', i - 1) }
if (has_eval) { texts[L + 1] = 'validation (at each evaluation)' }
item_w(i) = 0.06 + 0.0064 * strlen(texts[i])
total = 0
do for [i=1:items] { total = total + item_w(i) }
x = 0.5 - total / 2
ky = 1 - 48.0 / H
do for [i=1:items] {
  if (i <= L) {
    set arrow from screen x, screen ky to screen x + 0.03, screen ky nohead lw 1.5 lc rgb colour(i - 1)
  } else {
    set object circle at screen x + 0.015, screen ky size screen 0.004 fc rgb '#000000' fs solid
  }
  set label texts[i] at screen x + 0.036, screen ky left font ',9'
  x = x + item_w(i)
}

T0 = 1 - 70.0 / H; B0 = 50.0 / H
ph = (T0 - B0) / panels
set multiplot title sprintf('Balance inside the groups (%s, %d groups of %d experts)', run_name, M, S) font ',13' noenhanced
set lmargin at screen 0.09
set rmargin at screen 0.97

array names[3] = ['top_share', 'load_entropy', 'mean_pi_sq']
array titles[3] = [ \
  sprintf('top expert''s share of its group (mean over groups; 1/%d = balanced, 1 = collapsed)', S), \
  sprintf('entropy of the expert load / log %d (1 = uniform)', N), \
  sprintf('mean ||{/Symbol p}||^2 of the router (1/%d = uniform, 1 = one-hot)', N)]
array refs[3] = [1.0 / S, 1.0, 1.0 / N]
set xrange [x_first:x_last]
set yrange [0:1.05]
set ytics 0.2 format '%.1f'
do for [k=1:3] {
  set tmargin at screen T0 - (k - 1) * ph - 0.02
  set bmargin at screen T0 - k * ph + 0.035
  set title titles[k] offset 0,-0.6
  set xlabel (k == 3 ? 'training step' : '') offset 0,0.5
  set format x (k == 3 ? '%g' : '')
  if (has_eval) {
    plot for [l=0:L-1] data using 'step':(column(sprintf('%s_l%d', names[k], l))) \
           with lines lw 1.3 lc rgb colour(l) notitle, \
         for [l=0:L-1] evals using 'step':(column(sprintf('%s_l%d', names[k], l))) \
           with points pt 7 ps 0.9 lc rgb colour(l) notitle, \
         refs[k] with lines ls 100 notitle
  } else {
    plot for [l=0:L-1] data using 'step':(column(sprintf('%s_l%d', names[k], l))) \
           with lines lw 1.3 lc rgb colour(l) notitle, \
         refs[k] with lines ls 100 notitle
  }
  unset arrow  # the legend is drawn once
  unset label
  unset object
}

if (has_bias) {
  bias = sprintf('%s/balance_bias.dat', datadir)
  set tmargin at screen T0 - 3 * ph - 0.02 - 45.0 / H
  set bmargin at screen B0 + 0.01
  set title sprintf('balance controller: selection bias per expert at step %d', bias_step) offset 0,-0.6
  set xrange [-0.5:N - 0.5]
  set autoscale y
  set ytics autofreq format '%.2g'
  set xtics 1 format '%g'
  if (N > 16) { set xtics N / 16 }
  set xlabel 'expert' offset 0,0.5
  do for [g=1:M-1] {
    set arrow from g * S - 0.5, graph 0 to g * S - 0.5, graph 1 nohead back lc rgb '#bbbbbb' lw 2
  }
  plot for [l=0:L-1] bias using 'expert':(column(sprintf('bias_l%d', l))) \
         with linespoints lw 1.3 pt 7 ps 0.8 lc rgb colour(l) notitle, \
       0 with lines ls 100 notitle
}
unset multiplot
