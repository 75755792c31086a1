# Loss curves. Top: the training loss and its task cross-entropy per step
# (thin) with their moving averages (thick), the validation cross-entropy at
# each evaluation; the right axis reads the same curve as perplexity
# (exp of the cross-entropy). Bottom: the routing regularisation terms.
# Set by himoe-plot: out, format, datadir, run_name, aux (names of the non-zero
# terms among load intra inter z balance), smooth, final_step, final_ppl, x_first, x_last, ppl_tics
# (the right axis' tics: 'label' value, ...).
W = 900; H = 650
if (format eq 'svg') {
  set terminal svg size W,H dynamic enhanced font 'sans,11' background rgb 'white'
} else {
  set terminal pngcairo size W,H enhanced font 'sans,10'
}
set output out
loss = sprintf('%s/loss.dat', datadir)
evals = sprintf('%s/eval.dat', datadir)

set multiplot title sprintf('Training of %s', run_name) font ',13' noenhanced
set tics out nomirror
set xrange [x_first:x_last]
set grid lc rgb '#dddddd'
set lmargin at screen 0.09
set rmargin at screen 0.90

set tmargin at screen 0.91
set bmargin at screen 0.43
set title 'cross-entropy (nats per byte) and validation perplexity' offset 0,-0.5
set ylabel 'cross-entropy'
set y2label 'perplexity'
set format x ''
set link y2 via exp(y) inverse log(y)
eval 'set y2tics ('.ppl_tics.')'
set key top right box opaque samplen 2
plot loss using 1:'loss' with lines lc rgb '#c6dbef' lw 1 notitle, \
     loss using 1:'task' with lines lc rgb '#fdd0a2' lw 1 notitle, \
     loss using 1:'loss_avg' with lines lc rgb '#2171b5' lw 2 \
       title (smooth > 1 ? sprintf('train loss (task + regularisers), mean of %d steps', smooth) \
                         : 'train loss (task + regularisers)'), \
     loss using 1:'task_avg' with lines lc rgb '#e6550d' lw 2 \
       title 'train cross-entropy', \
     evals using 1:'val_loss' with linespoints lc rgb '#b2182b' pt 7 ps 1 lw 2 \
       title sprintf('validation cross-entropy (ppl %.3f at step %d)', final_ppl, final_step)
unset link y2
unset y2tics
unset y2label

set tmargin at screen 0.34
set bmargin at screen 0.08
unset title
set label 1 'routing regularisation terms (in the train loss)' at graph 0, graph 1.07 left
set format x '%g'
set xlabel 'training step' offset 0,0.5
set ylabel 'value'
set key at graph 1, graph 1.11 right top horizontal samplen 3 width 1 nobox
array colours[5] = ['#1b9e77', '#d95f02', '#7570b3', '#e7298a', '#66a61e']
array names[5] = ['load', 'intra', 'inter', 'z', 'balance']
array titles[5] = ['L_{load}', 'R_{intra}', 'R_{inter}', 'z-loss', 'balance controller']
if (strlen(aux) == 0) {
  set label 2 'no regularisation terms in this run' at graph 0.5, graph 0.5 center
  set yrange [-1:1]
  plot NaN notitle
} else {
  plot for [i=1:5] loss using 1:(strstrt(' '.aux.' ', ' '.names[i].' ') ? column(names[i]) : NaN) \
         with lines lw 1.2 lc rgb colours[i] \
         title (strstrt(' '.aux.' ', ' '.names[i].' ') ? titles[i] : '')
}
unset multiplot
